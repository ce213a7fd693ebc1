"""The LoRA adapters the api serves by name (`--lora-modules`, and at run time with
`--allow-runtime-lora-updating`): each is checked against the base model when it is named, so a
request's `model` resolves to the base (None) or to a checked adapter, and any other name is a 404.
"""

from __future__ import annotations

import os
import time
from typing import Any

from services.api.errors import ApiError
from shared.config import LoraConfig
from shared.lora import AdapterSpec, BaseShape, LoraError, check_adapter, parse_lora_modules
from shared.protocol import LoraRef


class Adapters:
    def __init__(self, base_name: str, model_dir: str, config: LoraConfig):
        self.base_name = base_name
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.roots = [os.path.realpath(root) for root in config.lora_roots or []]
        self._specs: dict[str, tuple[AdapterSpec, str, int]] = {}  # name -> (spec, parent, created)
        modules = parse_lora_modules(config.lora_modules or [])
        if modules and not self.enabled:
            raise LoraError("--lora-modules needs --enable-lora")
        self._base = BaseShape.of_model_dir(model_dir) if self.enabled else None
        for name, (path, parent) in modules.items():
            if parent is not None and parent != base_name:
                raise LoraError(f"--lora-modules: adapter {name!r} names base model {parent!r}; this server "
                                f"serves {base_name!r}")
            self.add(name, path)

    def add(self, name: str, path: str) -> AdapterSpec:
        """Check the adapter and serve it under `name`; raises LoraError."""
        if self._base is None:
            raise LoraError("this server serves no LoRA adapters (start it with --enable-lora)")
        if name == self.base_name:
            raise LoraError(f"{name!r} is the base model's name")
        if name in self._specs:
            raise LoraError(f"an adapter named {name!r} is already served")
        spec = check_adapter(name, path, self._base, self.max_rank)
        self._specs[name] = (spec, self.base_name, int(time.time()))
        return spec

    def add_at_run_time(self, name: str, path: str) -> AdapterSpec:
        """As `add`, for a path under one of `--lora-roots` only."""
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.roots):
            allowed = ", ".join(self.roots) if self.roots else "none: start the server with --lora-roots"
            raise LoraError(f"{path} is outside the folders adapters may be loaded from at run time ({allowed})")
        return self.add(name, real)

    def remove(self, name: str) -> bool:
        return self._specs.pop(name, None) is not None

    def resolve(self, model: str | None) -> LoraRef | None:
        """The adapter a request's `model` names, None for the base model; a 404 for any other name."""
        if model is None or model == self.base_name:
            return None
        held = self._specs.get(model)
        if held is None:
            served = ", ".join([repr(self.base_name), *map(repr, self._specs)])
            raise ApiError(f"the model '{model}' does not exist; this server serves {served}", status=404,
                           param="model", code="model_not_found")
        spec = held[0]
        return LoraRef(spec.name, spec.path, spec.rank, list(spec.targets))

    def cards(self, max_model_len: int | None) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, each naming its parent as vLLM's do."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "pagedserve", "root": spec.path,
                 "parent": parent, "max_model_len": max_model_len}
                for name, (spec, parent, created) in self._specs.items()]
