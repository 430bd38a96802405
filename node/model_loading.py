"""One model load at a time in a process.

transformers' `from_pretrained` (5.x) changes process-wide state while it builds a model and puts it back when
done: `torch.set_default_dtype` (`local_torch_dtype`) and `PreTrainedModel.tie_weights`, swapped for a no-op
(`no_tie_weights`). Each context saves what it finds and restores it on exit, so two threads loading at once can
leave the swap in place for good: a thread that entered second saved the no-op and restores it last. From then
on no model in the process ties its weights, and a model whose `lm_head` is tied to its embeddings (SmolLM2)
keeps `lm_head` on the meta device: "Cannot copy out of meta tensor" on `.to()`. Seen in a coordinator that
loaded its verifier's replay model while another thread loaded one (tests/unit/test_model_loading.py makes it
happen in four threads). vLLM's loader sets the default dtype the same way. Every load goes through `MODEL_LOADS`.
"""
from __future__ import annotations

import threading

# Reentrant: a load may build another model inside it (the real-model fixture dequantizes a GGUF file).
MODEL_LOADS = threading.RLock()
