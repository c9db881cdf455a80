"""A tic-tac-toe agent written with LangGraph (PyPI `langgraph`, `langchain-openai`), run unchanged by rlsys
(docs/agents.md): `ChatOpenAI` is built from the episode's client with `rlsys.agents.openai_kwargs`, so its
requests go through the proxy in the episode's session. LangSmith tracing is off (no network at run time).

A two-node graph (model -> tools, the tool returning directly): one model turn, stopped after the move. The
output is the tic-tac-toe agent's (docs/CONTRACTS.md): a call LangChain could not parse keeps its raw arguments
(`invalid_tool_calls`), for the reward to score as a parse error.
"""
import json
import os

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from rlsys.agents import openai_kwargs
from rlsys.envs.tictactoe.prompt import SYSTEM_PROMPT, user_message

os.environ["LANGSMITH_TRACING"] = "false"


@tool
def choose_square(square: int) -> str:
    """Place your X on a free square of the board. square: Square number 1-9, row by row from the top left."""
    return f"You played {square}."


def build_graph(llm):
    model = llm.bind_tools([choose_square])

    async def call_model(state: MessagesState) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([choose_square]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", END)  # the move is made: the episode ends
    return graph.compile()


async def agent(item, client, model):
    llm = ChatOpenAI(model=model, max_tokens=24, disable_streaming=True, **openai_kwargs(client))
    state = await build_graph(llm).ainvoke(
        {"messages": [SystemMessage(SYSTEM_PROMPT), HumanMessage(user_message(item["board"]))]})
    reply = next(m for m in state["messages"] if isinstance(m, AIMessage))
    calls = [{"name": c["name"], "arguments": json.dumps(c["args"])} for c in reply.tool_calls]
    calls += [{"name": c["name"], "arguments": c["args"]} for c in reply.invalid_tool_calls]
    return {"content": reply.content or None, "tool_calls": calls,
            "finish_reason": reply.response_metadata.get("finish_reason")}
