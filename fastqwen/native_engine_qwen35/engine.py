"""Native Transformers on Qwen3.5, as an engine folder: the baseline for Qwen3.5 checkpoints.

Transformers 5.17.0 `Qwen3_5ForCausalLM` (the judge runs this folder with .venv-qwen35
first on PYTHONPATH: fastqwen/refenv.py), BF16, sdpa attention with cuDNN's off, TF32
off, the torch fallback for the Gated DeltaNet (neither flash-linear-attention nor
causal-conv1d installed): one full-prompt forward with use_cache=True, then one forward
per token with the returned cache and logits_to_keep=1; argmax; `.tolist()` per step.
"""
import torch
from transformers import AutoModelForCausalLM


class Engine:
    def __init__(self, model_path: str):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="sdpa")
        self.model = model.to(self.device).eval()

    def generate(self, input_ids, max_new_tokens):
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1, :].argmax(dim=-1)
            del out
        yield token.tolist()
        for _ in range(max_new_tokens - 1):
            with torch.inference_mode():
                out = self.model(input_ids=token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
                token = out.logits[:, -1, :].argmax(dim=-1)
                del out
            yield token.tolist()
