"""The trainer's feed: which prompts go out and when (the ledger and its admission rule, the feeder's
side of the bus, datasets, eval rounds, a fresh start on a used run name, `jetrl prompts push`)."""
