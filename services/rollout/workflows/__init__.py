"""Built-in workflows: `rlvr:RLVRWorkflow` (the default), `multi_turn:MultiTurnWorkflow`, and
`synthetic:SyntheticWorkflow` (no model; for exercising the bus, failures and benchmarks)."""
