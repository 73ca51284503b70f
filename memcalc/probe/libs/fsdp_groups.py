"""FSDPMemTracker over FSDP2 units of several parameter groups: torchtitan's MoE block at ep > 1 over the FSDP2 ranks,
whose fully_shard (a per-parameter mesh, apply_fsdp_to_decoder's shard_placement_fn) makes one group of the routed
experts over efsdp and one of the rest over dp_shard. torch 2.13's tracker reads one group a unit
(FSDPState._fsdp_param_group, which raises for more); here each group is instrumented as it instruments a unit's one
group, and each of its hooks sees its own group while it runs.
"""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from typing import Any, Callable

from memcalc.probe import require_torch
from memcalc.probe.libs.hf_fsdp import FsdpMomentTracker
from memcalc.probe.shims import patched

torch = require_torch()
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState  # noqa: E402


class GroupsMomentTracker(FsdpMomentTracker):
    """FsdpMomentTracker for units of one or several parameter groups. While it tracks, a unit's group is the one
    whose backward hook runs; outside them (forward, where FSDP2 unshards every group of the unit at once) all its
    groups' parameters together."""

    def __enter__(self) -> GroupsMomentTracker:
        if self._depth == 0:
            self._running: dict[int, Any] = {}  # id(state) -> the group whose pre- or post-backward runs
            self._restore: list[tuple[Any, Callable, Callable]] = []
            self._patches = ExitStack()
            self._patches.enter_context(patched(FSDPState, _fsdp_param_group=property(self._group_of)))
        super().__enter__()
        return self

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            self._patches.close()

    def _group_of(self, state: FSDPState) -> Any:
        """What the tracker reads as a unit's one group: the only one (or None), the one whose hook runs, or all of
        them as one (their parameters, in order)."""
        groups = state._fsdp_param_groups
        if len(groups) < 2:
            return groups[0] if groups else None
        return self._running.get(id(state)) or SimpleNamespace(
            fsdp_params=[p for g in groups for p in g.fsdp_params], pre_backward=None, post_backward=None)

    def _instrument_fsdp_module(self) -> None:
        """The tracker's instrumentation (of all groups' sharded states at once), then each group's backward hooks
        wrapped as it wraps a unit's, each seeing its own group."""
        super()._instrument_fsdp_module()
        for module in self._root_mod.modules():
            state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
            for group in state._fsdp_param_groups if state is not None and len(state._fsdp_param_groups) > 1 else ():
                self._restore.append((group, group.pre_backward, group.post_backward))
                self._running[id(state)] = group  # as FsdpMomentTracker's post-backward wrapper reads it
                group.pre_backward = self._as_running(state, group, self._fsdp_param_group_pre_backward(
                    module, group.pre_backward))
                group.post_backward = self._as_running(state, group, self._fsdp_param_group_post_backward(
                    module, group.post_backward))
                del self._running[id(state)]

    def _as_running(self, state: FSDPState, group: Any, hook: Callable) -> Callable:
        """`hook` run with `group` as its unit's one group."""

        def run(*args, **kwargs):
            self._running[id(state)] = group
            try:
                return hook(*args, **kwargs)
            finally:
                del self._running[id(state)]

        return run

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for group, pre_backward, post_backward in self._restore:
            group.pre_backward, group.post_backward = pre_backward, post_backward
        self._restore.clear()
