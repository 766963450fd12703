"""AIME-style evaluation: problems (`data`), samplers (in-process vLLM or servers), grading with
math-verify under per-answer timeouts (`grading`), avg@k / pass@k / maj@k (`metrics`), and the
`beam-rl eval` command (`run`)."""
