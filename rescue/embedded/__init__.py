"""The embedded default and test bed: the privileged, scripted and vision-language policies, the
expert, the local VLM endpoint and its subgoal model, and (`training/`) what regenerates their
checkpoints. The product runs without it when a study names its own policy server and VLM."""
