"""Structured outputs: grammar-constrained decoding with xgrammar (docs/decisions.md says why xgrammar).

* `constraint.py`: the native request types (`OutputConstraint`, `ForcedToolCall`) and their proto parsing; no
  torch, no xgrammar, so the gRPC server can import it;
* `vocab.py`: the tml-renderers tokenizer's vocabulary as an xgrammar `TokenizerInfo`;
* `compiler.py`: a constraint -> the whole Inkling output block it allows (`<|message_model|><|content_text|>`
  ... `<|end_message|>`, or a tool-call block), compiled off the engine thread and cached by its hash;
* `matcher.py`: the per-request matcher the sampler masks with and advances;
* `sampling.py`: `GrammarMasks`, the sampler's persistent bitmask buffers: masks filled at sampling (queued
  behind the forward), applied to the logits in place, matchers advanced with the chosen tokens.
"""
