"""kvproc as a vLLM KV connector: `kvproc.integrations.vllm.connector.KvprocConnector` (docs/vllm.md).

Importing this package does not import vLLM; the connector module does.
"""
