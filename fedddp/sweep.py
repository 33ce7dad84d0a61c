"""``python -m fedddp.sweep``: the old name of ``python -m fedddp.study.sweep``, kept for one release."""
from fedddp.study import moved

moved("fedddp.sweep", "fedddp.study.sweep", __name__)
