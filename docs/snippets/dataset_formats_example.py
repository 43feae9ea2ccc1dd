"""GSM8K-format rows and a reasoning-gym task, as `GRPODataModule` maps them.

Run by tests/data/test_dataset_formats_doc.py.
"""

import json

from lightning_grpo import GRPODataModule
from lightning_grpo.rewards import accuracy, reasoning_gym

# A file in GSM8K's own columns: `question`, and `answer` ending in
# "#### <final answer>".
with open("gsm8k_sample.jsonl", "w") as f:
    question = "Tom has 1,200 cards and buys 34."
    answer = "1200 + 34 = 1234\n#### 1,234"
    f.write(json.dumps({"question": question, "answer": answer}) + "\n")

data = GRPODataModule(
    model="tiny-random",
    dataset="gsm8k_sample.jsonl",
    dataset_format="gsm8k",
)
data.check_data()  # setup() does the same; here just to look at the rows
row = data.train_prompts[0]
print(row["prompt"])  # the question, a blank line, "Put the final answer in \boxed{}."
print(row["answer"])  # 1234
completions = ["... so \\boxed{1234}.", "\\boxed{1243}"]
print(accuracy(completions, [row["answer"]] * 2))  # [1.0, 0.0]

# reasoning-gym's countdown: 8 problems with 3 numbers each, scored by the task's own
# score_answer.
data = GRPODataModule(
    model="tiny-random",
    dataset="reasoning_gym:countdown",
    dataset_size=8,
    dataset_options={"min_numbers": 3, "max_numbers": 3},
    reward_funcs=["lightning_grpo.rewards.reasoning_gym"],
)
data.check_data()
row = data.train_prompts[0]
names = ("answer", "metadata", "gym_task", "gym_options", "question")
columns = {name: [row[name]] * 2 for name in names}
completions = [f"<answer>{row['answer']}</answer>", "<answer>1 + 2</answer>"]
print(reasoning_gym(completions, **columns))  # [1.0, 0.05]
