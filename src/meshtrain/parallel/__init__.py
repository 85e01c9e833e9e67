"""Where models meet the mesh: wrappers that apply data (and later tensor/pipeline/context) parallelism."""
