"""`moe-control layers`: the converted layers a server's workers hold for RunMoE
(ListLayers), with their format, shape, memory and when each was last used."""

from __future__ import annotations

import argparse
from typing import Any

from service.cli import remote
from service.client.exits import EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "layers",
        help="the converted layers a server holds (for run --layer-id)",
        description="List the layers kept by ConvertWeights keep_loaded (ListLayers), least "
        "recently used first per worker; `unload LAYER_ID` drops one.",
    )
    parser.add_argument("--worker", type=int, help="only this worker's layers")
    remote.add_flags(parser, server_default=remote.DEFAULT_SERVER)
    parser.set_defaults(handler=run)


def render_table(layers: list[dict[str, Any]]) -> str:
    if not layers:
        return "no layers held (convert with --keep-loaded to keep one)"
    rows = [["LAYER", "WORKER", "DEVICE", "BACKEND", "BITS", "GROUP", "SHAPE", "MIB", "LAST USED"]]
    for layer in layers:
        fmt = layer["format"]
        shape = f"{layer['num_experts']}x{layer['hidden_size']}x{layer['intermediate_size']}"
        rows.append(
            [
                layer["layer_id"],
                str(layer["worker_index"]),
                layer["device"],
                fmt["backend"],
                str(fmt["bits"]),
                str(fmt["group_size"]),
                shape,
                f"{int(layer['byte_size']) / (1 << 20):.1f}",
                layer.get("last_used_time") or "-",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.inventory import list_layers

    try:
        layers = list_layers(remote.connection(args), worker_index=args.worker)
    except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
        return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json(layers)
    else:
        print(render_table(layers))
    return EXIT_OK
