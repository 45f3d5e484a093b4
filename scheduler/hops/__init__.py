"""The entry and exit hops, each on threads of its own: tokenizer pool, sender."""
