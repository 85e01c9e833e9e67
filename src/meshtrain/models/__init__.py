"""The models, one folder each (gpt/, vit/), each registered by the ModelSpec its __init__ builds (see
meshtrain.registry), and the transformer parts they share (transformer.py). Model files hold no distributed code;
each folder's parallelize.py is where its model meets the mesh, through the parameter names, which are therefore
part of the interface.
"""
