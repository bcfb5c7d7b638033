"""Generated from protos/moe_control/v1/."""
