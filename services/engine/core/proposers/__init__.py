"""Draft-free speculative decoding's proposers: plain Python guesses of a sequence's next tokens.

``NgramProposer`` looks the sequence's own prompt and output up (prompt lookup decoding);
``SuffixProposer`` adds an index of the model's recent outputs, shared across requests (suffix
decoding). Both are bounded in memory and in time per step; ``speculation.Speculator`` drives them.
"""
