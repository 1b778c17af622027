"""The served format: the z-lab layout vLLM and SGLang load, written from a checkpoint and read back.

``write.py`` (``dflash-export``: ``export_checkpoint``, the config.json it writes), ``load.py`` (what an export
must carry, ``load_export``), ``validate.py`` (an export's files checked before anything is read), ``serving.py``
(the standalone ``modeling_dflash.py``, assembled from the drafter variants' serving parts). It reads checkpoints
(checkpoint/) and asks the drafter variants (model/variants/); the readers (evaluation, the doctor, the export
command) read this format, not a checkpoint's internals.
"""
