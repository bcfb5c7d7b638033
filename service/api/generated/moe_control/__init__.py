"""Generated from protos/moe_control/."""
