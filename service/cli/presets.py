"""`moe-control presets`: the named platforms `select --gpu` accepts, with what each
assumes (device, capability, arch, packages, env), locally or as a server lists them."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli import remote
from service.client.exits import EXIT_OK
from service.oracle import PLATFORM_PRESETS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "presets",
        help="the platform presets --gpu accepts, and what each assumes",
        description="List the platform presets: device, compute capability, arch, the kernel "
        "packages each assumes installed (a CUDA preset: a stock vLLM install's humming and "
        "flashinfer; other devices: none) and env flags. Locally, or with --server as that "
        "server lists them (ListPlatformPresets).",
    )
    remote.add_flags(parser, server_default=None)
    parser.set_defaults(handler=run)


def local_presets() -> list[dict[str, Any]]:
    return [{"name": name, "profile": p.to_json()} for name, p in PLATFORM_PRESETS.items()]


def render_table(presets: list[dict[str, Any]]) -> str:
    rows = [["PRESET", "DEVICE", "CAPABILITY", "ARCH", "PACKAGES", "ENV"]]
    for entry in presets:
        profile = entry["profile"]
        env = " ".join(f"{k}={v}" for k, v in profile["env"].items())
        rows.append(
            [
                entry["name"],
                profile["device"],
                profile["capability"] or "-",
                profile["arch"] or "-",
                ",".join(profile["packages"]) or "none",
                env or "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run(args: argparse.Namespace) -> int:
    if args.server is None:
        presets = local_presets()
    else:
        import grpc

        from service.client.errors import ServerNotReadyError
        from service.client.inventory import list_presets

        try:
            presets = list_presets(remote.connection(args))
        except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
            return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json(presets)
    else:
        print(render_table(presets))
    return EXIT_OK
