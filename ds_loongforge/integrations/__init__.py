"""Where ds_loongforge meets DeepSpeed configs and transformers models.

``ds_loongforge.integrations.inject.inject(model, config)`` replaces a transformers model's modules per the
family presets in ``presets/``. It is not re-exported here: a package attribute named ``inject`` would
shadow the submodule of the same name.
"""
