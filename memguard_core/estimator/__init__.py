"""The preflight estimator: the peak memory of one fine-tuning process, with a breakdown.

``specs`` holds the inputs (``ModelSpec``, ``TrainSpec``; ``layout`` the parallel layout's checks);
the terms of memory have a module each (``weights``, ``gradients``, ``optimizer``, ``activations``,
``attention``, ``logits``, ``runtime``, ``vision``, ``bnb``), as have the devices (``cpu_heap``,
``cuda``, ``mps``, ``mlx``), LitGPT's model code (``litgpt``) and the data-parallel layouts
(``sharding``); ``estimate.estimate`` composes them. ``config_fields`` / ``numbers`` read a config's numbers and plain
numbers into a ``ModelSpec``; the adapters count a config on the meta device
(``memguard_hf.model_spec``) and a live module (``memguard_torch.module_spec``).
The rules and how their constants were fitted: docs/estimator.md.
"""
