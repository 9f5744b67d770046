"""What the stages import, for the local launcher's forkserver to import once
(``launcher: {name: local, options: {preload: [omni_transformers.preload]}}``): each stage process
then starts without importing transformers and the Qwen2.5-Omni modeling code itself."""

import torch  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoTokenizer, DynamicCache  # noqa: F401
from transformers.generation import logits_process  # noqa: F401
from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni  # noqa: F401

from omni_transformers.kit import sampling  # noqa: F401
from omni_transformers.qwen2_5_omni import processor, talker, thinker, token2wav  # noqa: F401
