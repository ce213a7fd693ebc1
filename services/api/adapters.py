"""The LoRA adapters the api serves by name, and to whom.

Adapters named by `--lora-modules` are shared by every tenant. One loaded at run time
(`--allow-runtime-lora-updating`) belongs to the tenant whose key loaded it (with several `--api-key`s each key
is a tenant; with one or none, every client is the same tenant): only that tenant sees it, uses it and unloads
it, and another tenant may load its own adapter under the same name. A shared adapter is unloaded only with the
admin key (`--admin-api-key`).

Each adapter is read whole and checked against the base model when it is named (shared/lora.py), off the event
loop, so a request's `model` resolves to the base (None) or to a checked adapter, and any other name is a 404.
The adapter is known everywhere else by its files' digest, so a name loaded again with other files is another
adapter.
"""

from __future__ import annotations

import os
import time
from typing import Any

from services.api.errors import ApiError
from shared.config import LoraConfig
from shared.lora import AdapterSpec, BaseShape, LoraError, check_adapter, parse_lora_modules
from shared.protocol import LoraRef

SHARED = None  # the owner of the adapters every tenant uses


class Adapters:
    def __init__(self, base_name: str, model_dir: str, config: LoraConfig):
        self.base_name = base_name
        self.enabled = config.enable_lora
        self.max_rank = config.max_lora_rank
        self.roots = [os.path.realpath(root) for root in config.lora_roots or []]
        self._specs: dict[tuple[str | None, str], tuple[AdapterSpec, int]] = {}  # (owner, name) -> spec, created
        modules = parse_lora_modules(config.lora_modules or [])
        if modules and not self.enabled:
            raise LoraError("--lora-modules needs --enable-lora")
        self._base = BaseShape.of_model_dir(model_dir) if self.enabled else None
        for name, (path, parent) in modules.items():
            if parent is not None and parent != base_name:
                raise LoraError(
                    f"--lora-modules: adapter {name!r} names base model {parent!r}; this server serves {base_name!r}"
                )
            self.add(name, path, SHARED)

    def add(self, name: str, path: str, owner: str | None, roots: list[str] | None = None) -> AdapterSpec:
        """Check the adapter (its files read whole) and serve it under `name` to `owner` (SHARED: to all); raises
        LoraError. It reads files: call it off the event loop."""
        if self._base is None:
            raise LoraError("this server serves no LoRA adapters (start it with --enable-lora)")
        if name == self.base_name:
            raise LoraError(f"{name!r} is the base model's name")
        if (owner, name) in self._specs or (SHARED, name) in self._specs:
            raise LoraError(f"an adapter named {name!r} is already served")
        spec = check_adapter(name, path, self._base, self.max_rank, roots or ())
        self._specs[(owner, name)] = (spec, int(time.time()))
        return spec

    def add_at_run_time(self, name: str, path: str, tenant: str) -> AdapterSpec:
        """As `add`, for the tenant, from a path under one of `--lora-roots` only (each of its files too)."""
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in self.roots):
            allowed = ", ".join(self.roots) if self.roots else "none: start the server with --lora-roots"
            raise LoraError(f"{path} is outside the folders adapters may be loaded from at run time ({allowed})")
        return self.add(name, real, tenant, self.roots)

    def remove(self, name: str, tenant: str, admin: bool) -> bool:
        """Stop serving the tenant's adapter `name` (or, with the admin key, a shared one); False if there is none.
        Requests running under it finish under it."""
        if self._specs.pop((tenant, name), None) is not None:
            return True
        if (SHARED, name) in self._specs:
            if not admin:
                raise ApiError(
                    f"the LoRA adapter '{name}' is shared by every tenant: only the admin key "
                    "(--admin-api-key) unloads it",
                    status=403,
                    param="lora_name",
                    code="permission_denied",
                )
            del self._specs[(SHARED, name)]
            return True
        return False

    def resolve(self, model: str | None, tenant: str) -> LoraRef | None:
        """The adapter a request's `model` names for its tenant, None for the base model; a 404 for any other
        name (another tenant's adapter included)."""
        if model is None or model == self.base_name:
            return None
        held = self._specs.get((tenant, model)) or self._specs.get((SHARED, model))
        if held is None:
            served = ", ".join([repr(self.base_name), *(repr(name) for name in self._visible(tenant))])
            raise ApiError(
                f"the model '{model}' does not exist; this server serves {served}",
                status=404,
                param="model",
                code="model_not_found",
            )
        spec = held[0]
        return LoraRef(spec.name, spec.path, spec.rank, list(spec.targets), spec.digest)

    def cards(self, max_model_len: int | None, tenant: str) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters the tenant sees, each naming its parent as vLLM's do."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "pagedserve",
                "root": spec.path,
                "parent": self.base_name,
                "max_model_len": max_model_len,
            }
            for name, (spec, created) in self._visible(tenant).items()
        ]

    def _visible(self, tenant: str) -> dict[str, tuple[AdapterSpec, int]]:
        return {name: held for (owner, name), held in self._specs.items() if owner in (SHARED, tenant)}
