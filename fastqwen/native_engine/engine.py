"""The platform's native baseline as a submittable engine folder.

Transformers `Qwen3ForCausalLM`, BF16, sdpa attention (cuDNN's off, as on the platform's
torch), TF32 off, under
inference mode: one full-prompt forward with `use_cache=True`, then one
forward per token with the returned cache and `logits_to_keep=1`; argmax of
the last logits; `.tolist()` per step. Every step pays full Python and
Transformers dispatch, exactly as the baseline the platform times.
"""
import torch
from transformers import Qwen3ForCausalLM


class Engine:
    def __init__(self, model_path: str):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        # The platform's torch 2.5.1 never picks cuDNN attention; newer torch does on
        # Hopper. Keep SDPA on the platform's kernels (flash) on every version.
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        model = Qwen3ForCausalLM.from_pretrained(
            model_path, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
        )
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
                out = self.model(
                    input_ids=token[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1
                )
                cache = out.past_key_values
                token = out.logits[:, -1, :].argmax(dim=-1)
                del out
            yield token.tolist()
