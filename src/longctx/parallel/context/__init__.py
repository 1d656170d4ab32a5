"""Context parallelism: a sequence over the head x ctx ranks (Ulysses all-to-all around ring or
Double-Ring attention), its layouts (zigzag, or balanced for packed documents: parallel.seq_balance)
and a rank's share of each batch."""
