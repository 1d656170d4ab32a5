"""`longctx eval`'s flag defaults that its parser (command.py) and its checks (request.py: a flag the task
would ignore is one given another value) both read, and --mode generate's new tokens that its checks
(request.py) and its run (generate_mode.py) both count; a leaf, so neither imports the other for them."""

DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"  # passkey / needle: where the needle sits, fractions of the filler
DEFAULT_BUCKETS = 16  # ppl: position buckets per length
EXTRA_NEW_TOKENS = 8  # generate mode: new tokens past the answer's length (room for a wrong or longer answer)
