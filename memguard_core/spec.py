"""The model and training specifications, re-exported from :mod:`memguard_core.estimator` where they
live now (``estimator.specs`` the types, ``estimator.readers_hf`` / ``readers_hf_meta`` /
``readers_torch`` / ``numbers`` the routes that build a ``ModelSpec``, ``estimator.trainable`` the
checks and trainable counts). Kept for the importers outside the estimator (issue 32: they move to the
new modules, then this module goes).
"""

from .estimator.layout import (OFFLOADS, SHARDINGS)
from .estimator.lora_targets import (peft_default_lora_targets, with_default_lora_targets)
from .estimator.numbers import model_spec_from_numbers
from .estimator.readers_hf import (DROPOUT_FIELDS, IMAGE_TILES_DEFAULT, IMAGE_TOKENS_DEFAULT_PX,
                                   VISION_TOWER_FAMILIES, dropout_probabilities, image_tokens_per_image,
                                   vision_tower_from_config)
from .estimator.readers_hf_meta import model_spec_from_hf_config
from .estimator.readers_torch import model_spec_from_module
from .estimator.specs import (ATTN_IMPLS, DEFAULT_LORA_TARGETS, DEVICES, DTYPES, FRAMEWORKS, GROUP64_OVERHEAD_BITS,
                              LinearShape, METHODS, MODEL_CODES, ModelSpec, NF4_BITS, NF4_DOUBLE_QUANT_BITS,
                              OPTIMIZERS, OPTIMIZER_ALIASES, PAGED_OPTIMIZERS, ParamCounts, TrainSpec, VisionTower,
                              optimizer_alias)
from .estimator.trainable import (check_train_spec, lora_trainable_params, routed_half_precision_on_cpu,
                                  trainable_params, vision_lora_linears, weights_for_training)

__all__ = ['ATTN_IMPLS', 'DEFAULT_LORA_TARGETS', 'DEVICES', 'DROPOUT_FIELDS', 'DTYPES', 'FRAMEWORKS',
           'GROUP64_OVERHEAD_BITS', 'IMAGE_TILES_DEFAULT', 'IMAGE_TOKENS_DEFAULT_PX', 'LinearShape',
           'METHODS', 'MODEL_CODES', 'ModelSpec', 'NF4_BITS', 'NF4_DOUBLE_QUANT_BITS', 'OFFLOADS',
           'OPTIMIZERS', 'OPTIMIZER_ALIASES', 'PAGED_OPTIMIZERS', 'ParamCounts', 'SHARDINGS', 'TrainSpec',
           'VISION_TOWER_FAMILIES', 'VisionTower', 'check_train_spec', 'dropout_probabilities',
           'image_tokens_per_image', 'lora_trainable_params', 'model_spec_from_hf_config',
           'model_spec_from_module', 'model_spec_from_numbers', 'optimizer_alias',
           'peft_default_lora_targets', 'routed_half_precision_on_cpu', 'trainable_params',
           'vision_lora_linears', 'vision_tower_from_config', 'weights_for_training',
           'with_default_lora_targets']
