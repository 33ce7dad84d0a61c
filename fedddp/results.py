"""``python -m fedddp.results``: the old name of ``python -m fedddp.study.results``, kept for one release."""
from fedddp.study import moved

moved("fedddp.results", "fedddp.study.results", __name__)
