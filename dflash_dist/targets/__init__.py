"""The frozen target's loading: everything about the HF model the drafter learns from, nothing about the drafter.

``hf.py`` (config, tokenizer, dtype, model construction, the frozen embedding / lm_head read by key),
``target_files.py`` (a target's directory and config checked where they enter), ``families/`` (what differs per
target family: layer kinds, packing rules, the drafter's MLP width), ``quant/`` (FP8 targets: formats, loading,
quantizing) and ``fast_path.py`` (which fast kernels a built target runs, and target.fast_path's policy). The
drafter's modelling (model/) reads the families; nothing here imports model/, the roles or the tools.
"""
