"""``python -m lab.ship_head``: train the embedded model's draft head and ship it.

The head that ``rag_spec/drafters/heads/`` ships is this script's output: ``rag-spec draft
train --head`` (``training.train_head.cached_head`` with its defaults: the stdlib corpus, 800
passages, 240 of the model's own answers and 1,200 to questions it wrote, 10 epochs, three
tokens deep; every draw seeded and the answers drafted by the trie alone, so a rerun trains the
same head up to floating-point summation order, whatever head is shipped), saved in half
precision under the fingerprint of the model it was trained for (``model_fingerprint``). About
an hour and a half on two CPU cores (87 minutes on the Xeon VM: answers 40, predictions 10,
training 37); a trained head in rag-spec's cache is reused.
"""

from __future__ import annotations

import sys

import torch

from rag_spec.drafters.draft_head import SHIPPED, model_fingerprint, save_head
from rag_spec.models import load_model
from rag_spec.training.train_head import cached_head


def main(model_name: str = "smollm2-135m-instruct") -> int:
    lm = load_model(model_name)
    head = cached_head(lm)
    SHIPPED.mkdir(exist_ok=True)
    path = SHIPPED / f"{model_fingerprint(lm.model)}.safetensors"
    save_head(head, path, dtype=torch.float16)
    print(f"{path} ({path.stat().st_size / 2**20:.1f} MiB): agreement {head.agreement}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
