"""Models: the MoE GPT language model and its named sizes (more to come: moefy, HF interop)."""

from moescale.models.gpt import GPT, GPTConfig, ParamCount, count_parameters
from moescale.models.sizes import SIZE_NAMES, gpt_config

__all__ = ["GPT", "GPTConfig", "ParamCount", "SIZE_NAMES", "count_parameters", "gpt_config"]
