"""fedddp: a federated-learning research runtime on torch.distributed.

One rank per device trains the clients it owns; rank 0 aggregates the stacked flat client
vectors with a server rule (fedddp.strategies). Entry point: ``python -m fedddp CONFIG``.
"""

__version__ = "0.1.0"
