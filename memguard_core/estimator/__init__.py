"""The preflight estimator: the peak memory of one fine-tuning process, with a breakdown.

``specs`` holds the inputs (``ModelSpec``, ``TrainSpec``; ``layout`` the parallel layout's checks);
the terms of memory have a module each (``weights``, ``gradients``, ``optimizer``, ``activations``,
``attention``, ``logits``, ``runtime``, ``vision``, ``bnb``), as have the devices (``cpu_heap``,
``cuda``, ``mps``, ``mlx``), LitGPT's model code (``litgpt``) and the data-parallel layouts
(``sharding``); ``estimate.estimate`` composes them. ``readers_hf`` / ``readers_hf_meta`` /
``readers_torch`` / ``numbers`` build a ``ModelSpec`` from a config, a live module or plain numbers.
The rules and how their constants were fitted: docs/estimator.md.
"""
