"""The zeroth-order optimizers' hyperparameters live where torch keeps them: in the one
parameter group of a ``torch.optim.Optimizer``, read at every step, so a torch LR
scheduler (``LambdaLR``, ``StepLR``, ``OneCycleLR(cycle_momentum=False)``, ...) drives
``lr``, and anything else set there is used from the next step on. Each step checks the
group first (a scheduler may have written a negative or non-finite value): a bad value
is refused naming it, with nothing written."""

import torch

from ..errors import check_nonnegative
from ..ops.stochastic_round import check_seed


def check_positive(name, value):
    return check_nonnegative(name, value, positive=True)


def check_call(call):
    if isinstance(call, bool) or not isinstance(call, int) or call < 0:
        raise ValueError(f"call must be a non-negative integer, got {call!r}")
    return call


def check_state(state, method: str, keys) -> None:
    """Refuse a state that is not a dict of ``method`` with every key in ``keys``, naming
    what is wrong, before anything of it is used."""
    if not isinstance(state, dict):
        raise TypeError(f"{method}: a state is the dict state_dict() returns, got {type(state).__name__}")
    if state.get("method") != method:
        raise ValueError(f"a {state.get('method')} state cannot be loaded into {method}")
    missing = [key for key in keys if key not in state]
    if missing:
        raise ValueError(f"{method}: the state lacks {missing}; nothing was loaded")


def hyperparameter(key: str) -> property:
    """``param_groups[0][key]``, read at each use (set it there, or let a scheduler)."""
    return property(lambda self: self.param_groups[0][key], doc=f"param_groups[0][{key!r}]")


class OneGroupOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` with one parameter group holding every trainable
    parameter and the hyperparameters ``HYPERPARAMETERS`` ({name: check(name, value)})."""

    method: str
    HYPERPARAMETERS: dict

    def _checked(self, values: dict, where: str = "") -> dict:
        """The hyperparameters in ``values``, each checked (``where`` prefixes a refusal)."""
        missing = [key for key in self.HYPERPARAMETERS if key not in values]
        if missing:
            raise ValueError(f"{self.method}: {where}lacks {missing}")
        return {key: check(f"{where}{key}", values[key]) for key, check in self.HYPERPARAMETERS.items()}

    def check_group(self) -> None:
        """Before every step and estimate: the group's hyperparameters checked."""
        group = self.param_groups[0]
        group.update(self._checked(group, "param_groups[0]: "))

    def __getstate__(self) -> dict:
        # every attribute (targets, seed, counter, ...), not only torch's defaults, state
        # and param_groups: a copy must still be this optimizer
        return dict(self.__dict__)

    def add_param_group(self, param_group: dict) -> None:
        if getattr(self, "param_groups", None):
            raise ValueError(f"{self.method} has one parameter group (every trainable parameter, perturbed "
                             f"together); another cannot be added")
        super().add_param_group(param_group)

    def group_state(self) -> list:
        """param_groups without the parameters: the hyperparameters and whatever a
        scheduler keeps there (initial_lr, ...), as ``state_dict`` saves them."""
        return [{key: value for key, value in self.param_groups[0].items() if key != "params"}]

    def checked_group_state(self, saved) -> dict:
        """A saved ``group_state`` checked, as the update to apply to the group."""
        if not isinstance(saved, list) or len(saved) != 1 or not isinstance(saved[0], dict):
            raise ValueError(f"{self.method}: the state's param_groups must be a list of one dict, got {saved!r}")
        group = {key: value for key, value in saved[0].items() if key != "params"}
        return {**group, **self._checked(group, "the state's param_groups[0]: ")}

    def resume(self, state: dict) -> None:
        """The seed, call counter and param_groups of ``state`` (already ``check_state``'d),
        each checked before any is assigned (a refused state changes nothing); the ranks'
        weights are compared again at the next step (``digest_weights``)."""
        seed = check_seed(state["seed"])
        call = check_call(state["call"])
        group = self.checked_group_state(state["param_groups"])
        self.seed, self.call, self.digest_weights = seed, call, True
        self.param_groups[0].update(group)
