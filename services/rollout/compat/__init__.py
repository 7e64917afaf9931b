"""The names AReaL's workflows, rewards and agents import from AReaL's utilities, written for jetrl
(docs/compat.md maps each one): `AsyncRewardWrapper`, `stats_tracker`, `logging.getLogger`,
`import_from_string`, `apply_chat_template`, `load_hf_tokenizer`, the perf tracer's decorators."""
