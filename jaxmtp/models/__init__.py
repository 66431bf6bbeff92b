"""Model architectures beside the DeepSeek-V3 family (whose modules are the top-level jaxmtp ones)."""
