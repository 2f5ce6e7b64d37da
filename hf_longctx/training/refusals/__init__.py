"""Every setting a trainer refuses, in one place: the tables of `TrainingArguments`, `Trainer`
parameters and TRL configs, and the construction checks."""
