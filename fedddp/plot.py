"""``python -m fedddp.plot``: the old name of ``python -m fedddp.study.plot``, kept for one release."""
from fedddp.study import moved

moved("fedddp.plot", "fedddp.study.plot", __name__)
