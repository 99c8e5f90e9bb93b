"""Algorithms: pure functions on tensors and integers, no I/O, no bus.

Modules:

- ``advantages``: reward shaping, group and batch normalisation, KL to a reference, DAPO overlong
  penalty and dynamic sampling, and ``compute_advantages`` (the one call the trainer makes).
- ``loss``: ``policy_loss`` (decoupled PPO, AReaL eq. 5, with the PPO/GRPO/Dr.GRPO/DAPO/GSPO switches)
  and the micro-batch-exact aggregation helpers; ``sft_loss``, the supervised loss on the same contract.
- ``staleness``: the controller's admission rule and the trainer's version guard.
- ``presets``: named loss recipes (``PRESETS``) and the loss field table (``LOSS_FIELDS``).

This package imports nothing on purpose: ``staleness`` and ``presets`` are torch-free so the
controller and ``config.py`` stay fast to import; import the submodule you need.
"""
