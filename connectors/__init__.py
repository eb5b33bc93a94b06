"""Code that runs inside the engines (installed as ``disagg_connectors``).

vLLM loads a connector from here through ``kv_connector_module_path``; nothing
in this package imports ``disagg`` itself, so an engine host needs only this
package and the engine.
"""
