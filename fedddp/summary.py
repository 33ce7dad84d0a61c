"""``python -m fedddp.summary``: the old name of ``python -m fedddp.study.summary``, kept for one release."""
from fedddp.study import moved

moved("fedddp.summary", "fedddp.study.summary", __name__)
