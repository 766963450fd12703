"""`beam-rl train-drafter`: DFlash2 drafters distilled from a Beam target's own generations."""
