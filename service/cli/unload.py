"""`moe-control unload LAYER_ID`: drop a kept layer from its worker (UnloadLayer), freeing
its device memory; an unknown id exits 1 with the server's NOT_FOUND message."""

from __future__ import annotations

import argparse

from service.cli import remote
from service.client.exits import EXIT_OK


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "unload",
        help="drop a converted layer a server holds",
        description="Unload a layer kept by ConvertWeights keep_loaded (UnloadLayer) and print "
        "the device memory freed. `layers` lists the ids.",
    )
    parser.add_argument("layer_id", metavar="LAYER_ID", help="as `layers` lists it")
    remote.add_flags(parser, server_default=remote.DEFAULT_SERVER)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from service.client.errors import ServerNotReadyError
    from service.client.inventory import unload_layer

    try:
        freed = unload_layer(remote.connection(args), args.layer_id)
    except (grpc.RpcError, ServerNotReadyError, ValueError) as error:
        return remote.report_failure(error, as_json=args.json)
    if args.json:
        remote.print_json({"layer_id": args.layer_id, "freed_bytes": freed})
    else:
        print(f"unloaded {args.layer_id}: freed {freed} bytes")
    return EXIT_OK
