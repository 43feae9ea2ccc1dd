"""A reward that reads a dataset column: the row's `keywords` arrive by name."""

from lightning_grpo.rewards import completion_text


def keyword_coverage(completions, keywords, **columns):
    """The fraction of the row's keywords that the completion mentions.

    `keywords` is the dataset column of that name: one entry per completion (each of a
    prompt's `num_generations` completions gets its row's value).
    """
    rewards = []
    for completion, words in zip(completions, keywords, strict=True):
        text = completion_text(completion).lower()
        rewards.append(sum(word.lower() in text for word in words) / len(words))
    return rewards
