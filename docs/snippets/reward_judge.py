"""A reward from a judge model: how likely it answers "Yes" to "is this correct?"."""

from lightning_grpo.rewards import completion_text

QUESTION = (
    "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Say Yes or No."
)


class Judge:
    """A small local judge model, loaded once in each process that scores.

    `score` is the place to call any judge: replace it to ask a hosted one (an
    OpenAI-compatible endpoint, a vLLM server) and return a number in [0, 1].
    """

    __name__ = "judge"  # the reward column's name: rewards/judge

    def __init__(self, model: str = "HuggingFaceTB/SmolLM2-135M-Instruct") -> None:
        self.model = model
        self._loaded = None  # (tokenizer, model): loaded at the first call

    def __call__(self, completions, prompts, **columns):
        pairs = zip(prompts, completions, strict=True)
        return [self.score(completion_text(p), completion_text(c)) for p, c in pairs]

    def score(self, prompt: str, completion: str) -> float:
        """P("Yes") / (P("Yes") + P("No")) for the judge's next token."""
        import torch

        tokenizer, model = self._load()
        question = QUESTION.format(prompt=prompt, completion=completion)
        inputs = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}],
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            logits = model(input_ids=inputs["input_ids"]).logits[0, -1]
        yes, no = (
            tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", "No")
        )
        return torch.softmax(logits[[yes, no]].float(), dim=0)[0].item()

    def _load(self):
        if self._loaded is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model)
            model = AutoModelForCausalLM.from_pretrained(self.model).eval()
            self._loaded = tokenizer, model
        return self._loaded

    def __getstate__(self):
        return {"model": self.model, "_loaded": None}  # a worker loads its own copy
