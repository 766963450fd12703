"""Built-in tasks: the synthetic arithmetic task, the math suite, their shipped tokenizer and rewards."""


class TaskSplits:
    """`train` and `heldout` of a task whose `_splits` gives (train problems, held-out problems)."""

    @property
    def train(self) -> list:
        return self._splits[0]

    @property
    def heldout(self) -> list:
        return self._splits[1]
