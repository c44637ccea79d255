import httpx, time, anthropic
B="http://127.0.0.1:22005"; MOCK="http://127.0.0.1:22004"
httpx.delete(MOCK+"/mock/responses"); httpx.post(MOCK+"/mock/responses", json={"text":"Hello there."})
t0=time.time()
with httpx.stream('POST', B+'/v1/messages', json={'model':'qwen3','max_tokens':50,'stream':True,'messages':[{'role':'user','content':'hi'}]}, timeout=60) as r:
    print('headers at', round(time.time()-t0,2), r.status_code)
    for line in r.iter_lines():
        if line.startswith('event:'): print(round(time.time()-t0,2), line)
c=anthropic.Anthropic(base_url=B, api_key='x', max_retries=0)
httpx.post(MOCK+"/mock/responses", json={"text":"Hello there."})
with c.messages.stream(model='qwen3',max_tokens=50,messages=[{'role':'user','content':'hi'}]) as s:
    fm=s.get_final_message()
print(fm.content, fm.usage)
