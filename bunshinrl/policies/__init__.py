"""LLM policies: a Hugging Face model in process (HFPolicy), an OpenAI-compatible server
(OpenAIPolicy), in-process vLLM (VLLMPolicy) and the server it is tested on, the chat rendering
and action text they share, per-decision seeds, constrained decoding and the turns they record.
bunshinrl.training trains them; torch is imported only by what needs it."""
