"""Loaded into vLLM's worker process (``--worker-extension-cls``): a weight reload that also
refreshes a tied LM head.

vLLM 0.32's in-place ``reload_weights`` loads every layer that has tensors in the checkpoint
and re-runs its post-load processing. A head tied to the embedding has no tensor of its own,
so its processing is not re-run: on CPU it keeps the oneDNN matmul handle built from a packed
copy of the *old* embedding, and the logits come from the old weights while the rest of the
model is new (measured: log-probs off by up to 0.25 after pushing a perturbed embedding).
The shared weight itself is updated; rebuilding the head's handle from it fixes the logits.
On GPU the head reads the shared weight directly, and the extra step does nothing.

``served_weights`` reports the directory last loaded, so that the sampler can check each server's
version after a push.

Imports nothing but ``typing``: it runs inside vLLM, which provides ``self.model_runner``.
"""

from typing import Any


class WeightReload:
    model_runner: Any  # vLLM's worker, which this class extends, sets it

    def reload_weights_and_tied_head(self, weights_path: str) -> None:
        self.model_runner.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            head.quant_method.process_weights_after_loading(head)
        self._orsd_weights = weights_path

    def served_weights(self) -> str | None:
        """The directory last loaded by ``reload_weights_and_tied_head`` (None: the model it started with)."""
        return getattr(self, "_orsd_weights", None)
