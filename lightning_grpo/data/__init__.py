"""What `GRPODataModule` resolves before anything starts: prompt sources (`sources`), the builtin tasks' table (`tasks`:
`arithmetic`, `calculator`, `number_guess`, reasoning-gym's tasks via `reasoning_gym`), the columns a dataset holds
for its rewards (`columns`), the dataset presets (`formats`: GSM8K, MATH, prompt + answer), the checks of its options
(`options`), and the tools, environments and prompt rendering of its conversations (`tooling`)."""
