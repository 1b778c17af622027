"""The two roles a rank plays, each in its own room: ``target_rank/`` (the frozen target: capture and send) and
``drafter_rank/`` (the drafter's training), which never import each other, and ``colocated.py``, the driver of a
rank that holds both."""
