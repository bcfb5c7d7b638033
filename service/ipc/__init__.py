"""What the server and its workers share across the process boundary, and nothing else.

The server side (`service.pool`) and the worker process (`service.worker`) sit on the same
floor and never import each other; both speak through this package: the JSON-lines pipe
protocol (`protocol`) and the tensor segment files both map (`segments`), with the errors
either side raises about them (`errors`). Nothing here imports torch or any other layer.
"""
