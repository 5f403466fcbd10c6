"""`inference --backend vllm`: vLLM's own server in this process, with asyncrl's routes mounted on it.

Only the modules that say so import vllm, and only the vLLM environment imports those. `launch.py`
is the other side: it runs in the main environment and starts such a server as a child process.
"""
