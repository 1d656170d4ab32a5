"""`longctx eval`'s flag defaults that its parser (command.py) and its checks (request.py: a flag the task
would ignore is one given another value) both read; a leaf, so neither imports the other for them."""

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"  # passkey / needle: where the needle sits, fractions of the filler
DEFAULT_BUCKETS = 16  # ppl: position buckets per length
