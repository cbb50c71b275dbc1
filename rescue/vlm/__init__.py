"""The VLM client: the `openai` SDK against any OpenAI-compatible endpoint, one bounded subgoal per case, a receipt for every attempt."""
